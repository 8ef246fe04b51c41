"""From a scheduled module to its collectives: pairs, windows, loops, threads.

A *schedule* is the instruction order of one computation that runs as a
sequence: the entry, while bodies and conditions, called computations and
conditional branches, and computations an async call runs on a thread of
its own. In each, every collective is found:

* a synchronous collective (`all-gather`, ...) is its own start and done;
* an async pair (`all-gather-start` ... `-done`, `send`/`recv` ...
  `send-done`/`recv-done`, `async-start`/`call-start` ... `-done`) is
  matched by following the start's value through tuples, get-tuple-element,
  opt-barriers and while loops (into the body, into the next iteration, out
  after the loop) to the done that consumes it;
* an `async-start`/`call-start` counts as a collective when what it wraps
  (through fusions and calls) holds exactly one collective and no compute;
  its kind is that collective's, never read from a name. Otherwise it is an
  async computation, whose own schedule is read in turn;
* a TPU async collective fusion chain (`async_fusions.py`: a start
  fusion, continuation fusions, a done fusion) is one collective, followed
  through its state from start to done; its continuations' fused compute is
  in its window (`Pair.continuations`, `Schedule.continuations`);
* `copy-start`/`copy-done` pairs are async copies, kept apart, and so are
  async slices (`async-start` of a lone slice; `as_text()`'s `slice-start`
  is written so by `reading/async_sugar.py`).

The window of a pair is the instructions strictly between start and done
along that path; its compute (fusions, custom calls, dots, convolutions,
and loops or calls holding them) is what the collective overlapped.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.reading.hlo_module import (
    MAIN_THREAD, HloComputation, HloInstruction, HloModule)
from jax_overlap._src.inspection.schedule import async_fusions

COLLECTIVE_OPCODES = frozenset({
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all",
    "collective-permute", "collective-broadcast", "ragged-all-to-all"})
_NATIVE_STARTS = {"all-gather-start": "all-gather",
                  "all-reduce-start": "all-reduce",
                  "collective-permute-start": "collective-permute"}
COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution"})
CONTROL_FLOW_OPCODES = frozenset({"while", "call", "conditional"})
#: Custom calls that only reserve memory (TPU): not work.
ALLOCATING_TARGETS = frozenset({"AllocateBuffer"})
#: Instructions that move no data of their own: names, views, bookkeeping,
#: and what pairs and loops account for (starts, dones, copies, sends).
_NO_WORK = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast",
    "after-all", "add-dependency", "opt-barrier", "partition-id",
    "replica-id", "domain", "get-dimension-size", "set-dimension-size",
    "rng-get-and-update-state", "send", "recv", "infeed", "outfeed"})
_MEANT_ASYNC = re.compile(
    r"(collective|all_gather|psum|psum_scatter|reduce_scatter|all_to_all|"
    r"ppermute|all_reduce)_start(\.\d+)?$")
_MAX_MOVES = 4


@dataclasses.dataclass
class Pair:
  """One collective (or async copy, or async call) from start to done.

  `role` is 'collective', 'copy' or 'call' (an async computation on its own
  thread, kept only so the model can wait for it). `moves` is the path from
  start to done: ('enter', while), ('next', while) or ('exit', while).
  `continuations` names the continuation fusions of a TPU async collective
  fusion chain between its start and done (each also in `overlapped` when it
  fuses compute; `async_fusions.fused_compute` names that compute).
  """

  role: str
  kind: str
  start: HloInstruction
  done: HloInstruction | None
  computation: str
  done_computation: str | None
  thread: str
  is_async: bool
  made_blocking: bool = False
  bytes: float = 0.0
  group_size: int | None = None
  overlapped: list[str] = dataclasses.field(default_factory=list)
  moves: tuple[tuple[str, str], ...] = ()
  loop: str | None = None
  trip_count: int | None = None
  callee: str | None = None
  continuations: list[str] = dataclasses.field(default_factory=list)

  @property
  def key(self) -> tuple[str, str | None]:
    return (self.start.name, self.done.name if self.done else None)

  @property
  def spans_iteration(self) -> bool:
    return bool(self.moves)


@dataclasses.dataclass
class Schedule:
  """What `read_schedule` finds. `schedules` maps each computation that runs
  as a sequence to its thread; `pairs_by_done[(computation, done)]` lists the
  pairs a done may finish, `pairs_by_start` likewise; `continuations[
  (computation, fusion)]` the chain pairs a continuation fusion carries."""

  module: HloModule
  pairs: list[Pair]
  schedules: dict[str, str]
  pairs_by_done: dict[tuple[str, str], list[Pair]]
  pairs_by_start: dict[tuple[str, str], list[Pair]]
  while_parents: dict[str, tuple[str, str]]
  reader: _Reader
  continuations: dict[tuple[str, str], list[Pair]] = dataclasses.field(
      default_factory=dict)

  def is_compute(self, instr: HloInstruction) -> bool:
    """A compute op holding no collective (fusion, custom call, dot,
    convolution), or a loop, call or conditional that holds compute."""
    return self.reader.is_compute(instr)

  def collectives(self) -> list[Pair]:
    return [p for p in self.pairs if p.role == "collective"]

  def copies(self) -> list[Pair]:
    return [p for p in self.pairs if p.role == "copy"]


def read_schedule(module: HloModule) -> Schedule:
  """Every collective and async copy in the schedules of `module`."""
  return _Reader(module).read()


def meant_async(instr: HloInstruction) -> bool:
  """Whether `instr` is a future's collective (its op_name ends in one of our
  `*_start` names, or it carries `async_collective_name`)."""
  if "async_collective_name" in attrs.frontend_attributes(instr):
    return True
  return bool(_MEANT_ASYNC.search(attrs.op_name(instr).rsplit("/", 1)[-1]))


def allocates(instr: HloInstruction) -> bool:
  """A custom call that only reserves memory."""
  return instr.opcode == "custom-call" and attrs.string_attribute(
      instr, "custom_call_target") in ALLOCATING_TARGETS


def is_standalone_work(instr: HloInstruction) -> bool:
  """Data movement outside any fusion (`Schedule.is_compute`): an array
  result of an op that is not bookkeeping, a collective, a pair's half or
  control flow."""
  op = instr.opcode
  if (op in _NO_WORK or op in COLLECTIVE_OPCODES or op in COMPUTE_OPCODES
      or op in CONTROL_FLOW_OPCODES or is_start(instr) or is_done(instr)
      or is_update(instr)):
    return False
  shape = instr.shape
  return not shape.is_tuple and not shape.is_token and bool(shape.dims) \
      and shape.bytes > 0


def is_start(instr: HloInstruction) -> bool:
  return instr.opcode.endswith("-start") or instr.opcode in ("send", "recv")


def is_done(instr: HloInstruction) -> bool:
  return instr.opcode.endswith("-done")


def is_update(instr: HloInstruction) -> bool:
  return instr.opcode.endswith("-update")


class _Reader:

  def __init__(self, module: HloModule):
    self.module = module
    self.comps = module.computations
    self._users_cache = {}
    self._holds: dict[str, tuple[list[HloInstruction], bool]] = {}
    self._roles: dict[int, str | None] = {}
    self.while_parents: dict[str, tuple[str, str]] = {}
    for comp in self.comps.values():
      for instr in comp.instructions:
        if instr.opcode == "while":
          for body in instr.callees("body"):
            self.while_parents.setdefault(body, (comp.name, instr.name))

  def chain_role(self, instr: HloInstruction) -> str | None:
    """`async_fusions.chain_role`, read once per instruction."""
    key = id(instr)
    if key not in self._roles:
      self._roles[key] = async_fusions.chain_role(instr, self.module)
    return self._roles[key]

  # --- what a computation holds -------------------------------------------

  def holds(self, comp_name: str) -> tuple[list[HloInstruction], bool]:
    """(collective instructions in `comp_name` and what it calls, whether it
    holds compute), following fusions, calls and async wrappers."""
    if comp_name in self._holds:
      return self._holds[comp_name]
    self._holds[comp_name] = ([], False)  # cycles cannot happen; be safe
    found, compute = [], False
    for instr in self.comps[comp_name].instructions:
      inner, inner_compute = self.instruction_holds(instr)
      found += inner
      compute = compute or inner_compute
    self._holds[comp_name] = (found, compute)
    return found, compute

  def instruction_holds(self, instr: HloInstruction):
    op = instr.opcode
    if op in COLLECTIVE_OPCODES or op in ("send", "recv") or (
        op.endswith("-start") and op[:-len("-start")] in COLLECTIVE_OPCODES):
      return [instr], False
    wraps = op in ("fusion", "call") or (
        is_start(instr) and op not in _NATIVE_STARTS and op != "copy-start")
    if not wraps:
      return [], op in COMPUTE_OPCODES and not async_fusions.is_marker(
          instr) and not allocates(instr)
    found, compute = [], False
    for callee in instr.callees("calls", "to_apply"):
      inner, inner_compute = self.holds(callee)
      found += inner
      compute = compute or inner_compute
    # A fusion is compute unless it is there to carry a collective.
    return found, compute or (op == "fusion" and not found)

  def is_compute(self, instr: HloInstruction) -> bool:
    """Counts as compute in a window: a compute op that holds no collective,
    a loop/call/conditional holding compute, or data movement standing
    alone (a copy, convert, broadcast, transpose, slice... outside any
    fusion: it reads and writes memory as a fusion does; the TPU demo
    step's took 1.9 ms of 15 measured). Scalars are the loops' bookkeeping,
    not work."""
    op = instr.opcode
    if op in COMPUTE_OPCODES:
      if allocates(instr):
        return False
      found, compute = self.instruction_holds(instr)
      return not found or compute
    if op in CONTROL_FLOW_OPCODES:
      return any(self.holds(c)[1] for c in instr.callees())
    return is_standalone_work(instr)

  # --- the walk -------------------------------------------------------------

  def read(self) -> Schedule:
    schedules: dict[str, str] = {}
    pairs: list[Pair] = []
    todo = [(self.module.entry.name, self.module.entry.execution_thread)]
    while todo:
      name, thread = todo.pop(0)
      if name in schedules:
        continue
      schedules[name] = thread
      comp = self.comps[name]
      for instr in comp.instructions:
        pairs += self._pairs_at(comp, instr, thread, todo)
        if instr.opcode in CONTROL_FLOW_OPCODES:
          for callee in instr.callees("body", "condition", "to_apply",
                                      "branch_computations",
                                      "true_computation", "false_computation"):
            todo.append((callee, self._thread_of(callee, thread)))
    pairs += self._unreached_chain_dones(pairs, schedules)
    by_done = collections.defaultdict(list)
    by_start = collections.defaultdict(list)
    by_continuation = collections.defaultdict(list)
    for pair in pairs:
      for name in pair.continuations:
        by_continuation[(pair.computation, name)].append(pair)
      by_start[(pair.computation, pair.start.name)].append(pair)
      if pair.done is not None:
        by_done[(pair.done_computation, pair.done.name)].append(pair)
    return Schedule(self.module, pairs, schedules, dict(by_done),
                    dict(by_start), self.while_parents, self,
                    dict(by_continuation))

  def _unreached_chain_dones(self, pairs, schedules) -> list[Pair]:
    """A chain's done that no start reached (a form we do not follow) is
    kept as a collective of its own, with the collective's bytes."""
    reached = {(p.done_computation, p.done.name) for p in pairs if p.done}
    out = []
    for name, thread in schedules.items():
      comp = self.comps[name]
      for instr in comp.instructions:
        if (name, instr.name) in reached or \
            self.chain_role(instr) != "done":
          continue
        inner = async_fusions.fused_collective(instr, self.module)
        if inner is None:
          continue
        out.append(Pair("collective", _kind(inner), instr, instr, name, name,
                        thread, is_async=False, bytes=_payload_bytes(inner.shape),
                        group_size=attrs.group_size(inner, self.module)))
    return out

  def _thread_of(self, comp_name: str, default: str) -> str:
    thread = self.comps[comp_name].execution_thread
    return thread if thread != MAIN_THREAD else default

  def _pairs_at(self, comp, instr, thread, todo) -> list[Pair]:
    op = instr.opcode
    role = self.chain_role(instr)
    if role == "start" and async_fusions.fused_collective(instr, self.module):
      inner = async_fusions.fused_collective(instr, self.module)
      return self._follow(comp, instr, "collective", _kind(inner), thread,
                          inner, chain=True)
    if role is not None:
      return []  # a continuation or done: the start's pair holds it
    if op in COLLECTIVE_OPCODES or (op == "fusion" and
                                    self.instruction_holds(instr)[0]):
      inner = instr if op in COLLECTIVE_OPCODES else \
          self.instruction_holds(instr)[0][0]
      return [Pair("collective", _kind(inner), instr, instr, comp.name,
                   comp.name, thread, is_async=False,
                   made_blocking=self._meant_async(instr),
                   bytes=_done_bytes(instr),
                   group_size=attrs.group_size(inner, self.module))]
    if not is_start(instr):
      return []
    if op == "copy-start":
      return self._follow(comp, instr, "copy", "copy", thread, None)
    if op in _NATIVE_STARTS or op in ("send", "recv"):
      kind = _NATIVE_STARTS.get(op, op)
      return self._follow(comp, instr, "collective", kind, thread, instr)
    # An async wrapper: written out (async-start, call-start) or as sugar
    # (`reduce-scatter-start` carries the wrapped op's attributes itself).
    explicit = op in ("async-start", "call-start")
    wrapped = op[:-len("-start")]
    thread = self._wrapper_thread(instr, thread)
    if not explicit and wrapped in COLLECTIVE_OPCODES:
      return self._follow(comp, instr, "collective", wrapped, thread, instr)
    if explicit and self._wraps_a_slice(instr):
      return self._follow(comp, instr, "copy", "copy", thread, None)
    found, compute = self.instruction_holds(instr)
    if len(found) == 1 and not compute:
      inner = found[0]
      kind = _kind(inner)
      return self._follow(comp, instr, "collective", kind, thread, inner)
    callee = self._own_schedule(instr)
    if callee is None:
      return []
    todo.append((callee, thread))
    return self._follow(comp, instr, "call", "call", thread, None,
                        callee=callee)

  def _wraps_a_slice(self, instr) -> bool:
    """An async slice (TPU's `slice-start`, a dump's `async-start` of a
    slice): a transfer by the copy engine, like `copy-start`."""
    callees = instr.callees("calls")
    if len(callees) != 1 or callees[0] not in self.comps:
      return False
    real = [i.opcode for i in self.comps[callees[0]].instructions
            if i.opcode not in ("parameter", "tuple", "get-tuple-element")]
    return real in (["slice"], ["dynamic-slice"])

  def _wrapper_thread(self, instr, default) -> str:
    thread = attrs.string_attribute(instr, "async_execution_thread")
    if thread:
      return thread
    for callee in instr.callees("calls", "to_apply"):
      if self.comps[callee].execution_thread != MAIN_THREAD:
        return self.comps[callee].execution_thread
    return default

  def _own_schedule(self, instr) -> str | None:
    """The computation an async call runs: through a lone `call` inside."""
    callees = instr.callees("calls", "to_apply")
    if not callees:
      return None
    comp = self.comps[callees[0]]
    real = [i for i in comp.instructions
            if i.opcode not in ("parameter", "tuple", "get-tuple-element")]
    if len(real) == 1 and real[0].opcode == "call":
      return real[0].callees("to_apply")[0]
    return comp.name

  def _meant_async(self, instr) -> bool:
    return meant_async(instr)

  def _follow(self, comp, start, role, kind, thread, inner,
              callee=None, chain=False) -> list[Pair]:
    """One pair per done the start's value reaches (for a fusion chain,
    `chain`, the done fusion its state reaches)."""
    config = attrs.backend_config(start).get("collective_backend_config", {})
    made_blocking = isinstance(config, dict) and config.get("is_sync") is True
    group = attrs.group_size(inner, self.module) if inner is not None else None
    out = []
    continuations: list[str] = []
    reached = self._reach(comp, start, continuations if chain else None)
    if chain and not reached:
      return []  # its done is kept on its own (_unreached_chain_dones)
    if not reached:
      return [Pair(role, kind, start, None, comp.name, None, thread,
                   is_async=not made_blocking, made_blocking=made_blocking,
                   bytes=_start_bytes(start), group_size=group, callee=callee)]
    for moves, done_comp, done in reached:
      loop, trip = self._loop(moves)
      window = [] if made_blocking else self._window(comp, start, moves,
                                                     done_comp, done)
      if chain:  # the collective's own result, not the state tuples
        nbytes = _payload_bytes(inner.shape)
      elif start.opcode == "send":
        nbytes = _start_bytes(start)
      else:
        nbytes = _done_bytes(done)
      out.append(Pair(role, kind, start, done, comp.name, done_comp.name,
                      thread, is_async=not made_blocking,
                      made_blocking=made_blocking, bytes=nbytes,
                      group_size=group, overlapped=window, moves=moves,
                      loop=loop, trip_count=trip, callee=callee,
                      continuations=list(continuations)))
    return out

  def _users(self, comp: HloComputation):
    if comp.name not in self._users_cache:
      self._users_cache[comp.name] = comp.users()
    return self._users_cache[comp.name]

  def _reach(self, comp, start, continuations=None):
    """[(moves, computation, done)] for each done `start`'s value reaches,
    fewest moves first. With `continuations` (a list, filled in), `start`
    is a fusion chain's: its state passes through the continuations it
    reaches (named there, in order) to the chain's done."""
    chain = continuations is not None
    found: dict[tuple[str, str], tuple] = {}
    queue = collections.deque([(comp, start, (), ())])
    seen = set()
    while queue:
      c, x, path, moves = queue.popleft()
      state = (c.name, x.name, path, moves)
      if state in seen or len(moves) > _MAX_MOVES:
        continue
      seen.add(state)
      for user, k in self._users(c).get(x.name, []):
        role = self.chain_role(user) if chain else None
        if chain and not path and role in ("done", "continuation"):
          if role == "done":
            old = found.get((c.name, user.name))
            if old is None or len(moves) < len(old[0]):
              found[(c.name, user.name)] = (moves, c, user)
          else:
            carried = async_fusions.state_operands(user)
            if carried is None or k in carried:
              if user.name not in continuations:
                continuations.append(user.name)
              queue.append((c, user, (), moves))
          continue
        if chain and not path and user.opcode == "get-tuple-element" and \
            self._carries_state(x, user):
          queue.append((c, user, (), moves))
          continue
        if chain and is_done(user):
          continue
        if is_done(user) and not path:
          old = found.get((c.name, user.name))
          if old is None or len(moves) < len(old[0]):
            found[(c.name, user.name)] = (moves, c, user)
        elif is_update(user) and not path:
          queue.append((c, user, (), moves))
        elif user.opcode == "tuple":
          queue.append((c, user, (k,) + path, moves))
        elif user.opcode == "get-tuple-element":
          index = attrs.integer_list(user.attributes.get("index"))
          if path and index and path[0] == index[0]:
            queue.append((c, user, path[1:], moves))
        elif user.opcode == "opt-barrier":
          queue.append((c, user, path, moves))
        elif user.opcode == "while" and k == 0:
          body = self.comps[user.callees("body")[0]]
          for param in body.parameters[:1]:
            queue.append((body, param, path, moves + (("enter", user.name),)))
      if x.is_root and c.name in self.while_parents:
        parent_name, while_name = self.while_parents[c.name]
        if not any(m[0] == "next" for m in moves):
          for param in c.parameters[:1]:
            queue.append((c, param, path, moves + (("next", while_name),)))
        parent = self.comps[parent_name]
        queue.append((parent, parent.by_name[while_name], path,
                      moves + (("exit", while_name),)))
    return sorted(found.values(), key=lambda f: len(f[0]))

  def _carries_state(self, link, gte) -> bool:
    """Whether `gte`, an element of chain link `link`, is chain state."""
    role = self.chain_role(link)
    if role == "start":
      return True
    if role != "continuation":
      return False
    index = attrs.integer_list(gte.attributes.get("index"))
    state = async_fusions.state_outputs(link)
    return bool(index) and (state is None or index[0] in state)

  def _loop(self, moves) -> tuple[str | None, int | None]:
    if not moves:
      return None, None
    while_name = moves[0][1]
    for comp in self.comps.values():
      if while_name in comp.by_name:
        return while_name, attrs.known_trip_count(comp.by_name[while_name])
    return while_name, None

  def _window(self, comp, start, moves, done_comp, done) -> list[str]:
    """Names of the compute instructions strictly between start and done."""
    if [m[0] for m in moves] == ["enter", "exit"]:
      moves = ()  # the value only passed through: the loop is in the window
    segments = []
    cur, pos = comp, comp.position[start.name] + 1
    for kind, while_name in moves:
      if kind == "enter":
        segments.append((cur, pos, cur.position[while_name]))
        w = cur.by_name[while_name]
        cur, pos = self.comps[w.callees("body")[0]], 0
      elif kind == "next":
        segments.append((cur, pos, len(cur.instructions)))
        pos = 0
      else:  # exit
        segments.append((cur, pos, len(cur.instructions)))
        cur = self.comps[self.while_parents[cur.name][0]]
        pos = cur.position[while_name] + 1
    segments.append((cur, pos, cur.position[done.name]))
    return [i.name for c, a, b in segments for i in c.instructions[a:b]
            if self.is_compute(i)]


def _kind(instr: HloInstruction) -> str:
  op = instr.opcode
  return op[:-len("-start")] if op.endswith("-start") else op


def _payload_bytes(shape) -> float:
  """Logical bytes of a result, tokens and a tuple's scalar contexts aside."""
  if not shape.is_tuple:
    return shape.bytes
  return sum(s.bytes for s in shape.leaves()
             if not (s.dims == () and s.dtype in ("u32", "s32")))


def _done_bytes(instr: HloInstruction) -> float:
  return _payload_bytes(instr.shape)


def _start_bytes(instr: HloInstruction) -> float:
  """The payload of a send (the data element of its tuple), or the result
  part of a start whose done was not found."""
  shape = instr.shape
  if not shape.is_tuple or not shape.elements:
    return _payload_bytes(shape)
  if instr.opcode == "send" or len(shape.elements) == 1:
    return _payload_bytes(shape.elements[0])
  return _payload_bytes(shape.elements[1])
