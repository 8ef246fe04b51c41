"""What a perfect schedule of a computation could not hide, given its data
dependencies.

A collective's transfer can hide only behind compute that neither feeds it
(an ancestor of its start) nor uses it (a descendant of its done): anything
else must run before the transfer begins or after it ends. Transfers on one
link run one at a time, and a piece of compute runs once, so the most a
perfect schedule hides on a link is a maximum flow: from each piece of
compute (its modelled seconds), to the transfers on that link it is
independent of, to a sink (each transfer's modelled seconds). What is left,
`comm(link) - flow`, is exposed in every schedule that keeps the data
dependencies; the computation's bound is the largest over its links. (The
flow lets a piece of compute be split between transfers, so it is a bound,
never more than what can be hidden.)

In a loop body run at least twice, compute of the neighbouring iteration
counts too: a transfer of iteration i can hide behind compute of iteration
i-1 unless it reads a loop-carried value that compute produces, or behind
compute of iteration i+1 unless that compute reads a value the transfer
produces. Loop-carried values are the elements of the body's parameter
tuple and of its root tuple.

Example: what stays exposed of a 3 s transfer beside 5 s of compute that
depends on it (all of it), and beside 5 s of independent compute (nothing).
  >>> flow_bound({"c": 3.0}, {"o": 5.0}, {("o", "c")})
  3.0
  >>> flow_bound({"c": 3.0}, {"o": 5.0}, set())
  0.0
"""

from __future__ import annotations

import collections
import dataclasses

_EPS = 1e-15
#: Past this many (compute group, transfer) edges the flow is not solved; the
#: hideable part is then bounded by simple sums (still never too small a bound
#: of what is hidden).
_MAX_EDGES = 200_000


@dataclasses.dataclass
class Transfer:
  """A collective started in the computation: its start, its done (None when
  the done is in another computation or iteration), its modelled seconds and
  link. `consumer` is the loop of this computation whose body holds the done
  (it and what follows it use the result), and `lead_s` the compute of that
  body before the done, which the transfer may hide behind (a loop is one
  node here, so that part is counted apart)."""

  start: str
  done: str | None
  seconds: float
  link: str
  consumer: str | None = None
  lead_s: float = 0.0


class Dependencies:
  """Ancestors and descendants of every instruction of one computation, and
  which loop-carried elements each reads and feeds (for a loop body)."""

  def __init__(self, comp, is_loop_body: bool):
    self.comp = comp
    instrs = comp.instructions
    self.bit = {i.name: 1 << k for k, i in enumerate(instrs)}
    by_name = comp.by_name
    self.anc: dict[str, int] = {}
    for instr in _topological(instrs, by_name):
      mask = 0
      for op in instr.operands:
        if op in by_name:
          mask |= self.anc[op] | self.bit[op]
      self.anc[instr.name] = mask
    users = collections.defaultdict(list)
    for instr in instrs:
      for op in instr.operands:
        if op in by_name:
          users[op].append(instr.name)
    self.desc: dict[str, int] = {}
    for instr in reversed(_topological(instrs, by_name)):
      mask = 0
      for u in users[instr.name]:
        mask |= self.desc[u] | self.bit[u]
      self.desc[instr.name] = mask
    self._feeds: dict[str, int] = {}
    self.carried = is_loop_body and self._read_carry(instrs, by_name)

  def _read_carry(self, instrs, by_name) -> bool:
    params = [i for i in instrs if i.opcode == "parameter"]
    root = self.comp.root
    if len(params) != 1 or root.opcode != "tuple":
      return False
    param = params[0].name
    every = (1 << len(root.operands)) - 1
    self.reads: dict[str, int] = {}
    for instr in _topological(instrs, by_name):
      mask = 0
      for op in instr.operands:
        if op == param:
          if instr.opcode == "get-tuple-element":
            index = instr.attributes.get("index", "").strip()
            mask |= (1 << int(index)) if index.isdigit() else every
          else:
            mask |= every
        elif op in self.reads:
          mask |= self.reads[op]
      self.reads[instr.name] = mask
    # feeds_root[k]: the instructions element k of the next carry is made of.
    self.root_parts = [
        (self.anc[op] | self.bit[op]) if op in self.bit else 0
        for op in root.operands]
    return True

  def feeds(self, name: str) -> int:
    """The loop-carried elements `name`'s value reaches."""
    if name not in self._feeds:
      bit = self.bit[name]
      self._feeds[name] = sum(1 << k for k, part in enumerate(self.root_parts)
                              if part & bit)
    return self._feeds[name]

  def independent(self, compute: str, t: Transfer) -> bool:
    """Whether `compute` can run while `t` is in flight, in this iteration
    or (in a loop body) the one before or after."""
    if compute not in self.bit:   # the lead of a loop holding a done
      return compute == f"lead of {t.start}"
    bit = self.bit[compute]
    after = self.desc[t.done] if t.done in self.desc else 0
    if t.consumer in self.desc:
      after |= self.desc[t.consumer] | self.bit[t.consumer]
    if not (self.anc[t.start] & bit or after & bit):
      return True
    if not self.carried:
      return False
    produced_by_t = self.feeds(t.done if t.done in self.bit else t.start)
    # Iteration i-1's compute, unless the transfer reads what it carried.
    if not self.reads[t.start] & self.feeds(compute):
      return True
    # Iteration i+1's compute, unless it reads what the transfer carried.
    return not self.reads[compute] & produced_by_t


def _topological(instrs, by_name):
  """`instrs` with every operand before its user (a scheduled computation is
  already in that order; a hand-written one may not be)."""
  seen, out = set(), []
  for instr in instrs:
    if instr.name in seen:
      continue
    stack = [(instr, False)]
    while stack:
      x, expanded = stack.pop()
      if x.name in seen:
        continue
      if expanded:
        seen.add(x.name)
        out.append(x)
        continue
      stack.append((x, True))
      for op in x.operands:
        if op in by_name and op not in seen:
          stack.append((by_name[op], False))
  return out


def computation_bound(deps: Dependencies, compute: dict[str, float],
                      transfers: list[Transfer]) -> float:
  """The computation's bound: the largest over its links of what the
  transfers on it cannot hide behind `compute` (name -> modelled seconds)."""
  by_link = collections.defaultdict(list)
  for t in transfers:
    if t.seconds > 0:
      by_link[t.link].append(t)
  best = 0.0
  compute = dict(compute)
  for t in transfers:
    if t.lead_s > 0:
      compute[f"lead of {t.start}"] = t.lead_s
  for link_transfers in by_link.values():
    seconds = {f"{k}": t.seconds for k, t in enumerate(link_transfers)}
    dependent = {(name, f"{k}") for name, d in compute.items() if d > 0
                 for k, t in enumerate(link_transfers)
                 if not deps.independent(name, t)}
    best = max(best, flow_bound(seconds, compute, dependent))
  return best


def flow_bound(transfers: dict[str, float], compute: dict[str, float],
               dependent: set[tuple[str, str]]) -> float:
  """`sum(transfers) - ` the most of them that can hide behind `compute`,
  where a (compute, transfer) in `dependent` cannot overlap."""
  total = sum(transfers.values())
  # Compute with the same set of transfers it may hide is one source.
  groups: dict[frozenset, float] = collections.defaultdict(float)
  for name, d in compute.items():
    if d <= 0:
      continue
    allowed = frozenset(t for t in transfers if (name, t) not in dependent)
    if allowed:
      groups[allowed] += d
  if not groups:
    return total
  edges = sum(len(g) for g in groups)
  if edges > _MAX_EDGES:
    hidden = min(total, sum(groups.values()),
                 sum(min(s, sum(d for g, d in groups.items() if t in g))
                     for t, s in transfers.items()))
    return max(0.0, total - hidden)
  return max(0.0, total - _max_flow(groups, transfers))


def _max_flow(groups: dict[frozenset, float],
              transfers: dict[str, float]) -> float:
  """Max flow source -> group -> transfer -> sink (Edmonds-Karp; the graphs
  are a few hundred nodes)."""
  names = ["s", "t"] + [("g", k) for k in range(len(groups))] + \
      [("c", t) for t in transfers]
  index = {n: k for k, n in enumerate(names)}
  cap: list[dict[int, float]] = [collections.defaultdict(float) for _ in names]
  inf = sum(transfers.values()) + sum(groups.values()) + 1.0
  for k, (allowed, d) in enumerate(groups.items()):
    g = index[("g", k)]
    cap[0][g] += d
    for t in allowed:
      cap[g][index[("c", t)]] += inf
  for t, s in transfers.items():
    cap[index[("c", t)]][1] += s
  flow = 0.0
  while True:
    parent = {0: None}
    queue = collections.deque([0])
    while queue and 1 not in parent:
      u = queue.popleft()
      for v, c in cap[u].items():
        if c > _EPS and v not in parent:
          parent[v] = u
          queue.append(v)
    if 1 not in parent:
      return flow
    path, v = [], 1
    while parent[v] is not None:
      path.append((parent[v], v))
      v = parent[v]
    push = min(cap[u][v] for u, v in path)
    for u, v in path:
      cap[u][v] -= push
      cap[v][u] += push
    flow += push
