"""The cost model and the simulation: modelled seconds, exposed time, the bound."""
