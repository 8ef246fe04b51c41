"""`fsdp_scan`: a stack of layers whose weight gathers hide behind compute."""
