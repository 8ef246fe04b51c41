"""Reading HLO: dump text and live compiles, into one `HloModule`."""
