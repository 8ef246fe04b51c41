"""`expert_parallel`: mixture-of-experts dispatch and combine hidden behind the experts.

One idea a module: `arguments` (the checks at the call), `layout` (which
(token, choice) goes to which slot, the capacity rule, the dropped count),
`varying` (buffers typed to vary like the tokens they hold), `transport`
(how a chunk's slots travel: padded buffers with a capacity, a ragged
exchange dropless), `ragged_exchange` (the dropless exchange of the routed
rows, per platform), `pipeline` (the chunked, fenced schedule shared by the
forward and backward passes), `expert_parallel` (the public function and
its `custom_vjp`) and `stream` (`expert_stream`: token groups sent one at a
time, each exchange a future the caller's work hides). See docs/moe.md.
"""
