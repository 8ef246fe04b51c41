"""Pipeline parallelism in one SPMD program: a planner and one executor.

`placing.py` turns a schedule's name into a `PipelinePlan` (plan.py: a table
of actions, one a tick and device), placing the schedule's order (orders.py)
on ticks; `executor.py` runs any plan inside `shard_map`, one
tick after another, each device's action chosen by its axis index, each
stage-to-stage send a `ppermute_start` future; `loss.py` wraps the run in a
`custom_vjp` whose backward is the schedule's own.
"""
