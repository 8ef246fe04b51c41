"""`program_order` and its lowering-time barriers. Design notes: README.md beside this file."""
