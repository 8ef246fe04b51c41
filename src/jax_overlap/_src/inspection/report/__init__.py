"""The report and its renderings: records, table, pictures, diff."""
