"""The rehearsal: one rank of a training plan run by the real trainer on fake tensors, at
any world size, on a box without the plan's hardware (``rehearse``; on fake ``cuda`` through
the fake GPU, ``fake_gpu``; each rank in a process forked from a warm ``rank_server``;
DDP's stand-in ``rehearsed_ddp``; the torch release it was checked on, ``torch_pin``), and
the plan stage's give-way rule over the planner's best plans (``plans``). It sits above
``model.training`` (it builds the trainer) and ``model.planner`` (it checks the planner's
plans); neither imports it."""
