"""The parallel-plan search: plans, shapes, memory and time models, clusters, calibration.

Everything here imports without torch so that plans can be made on a laptop; the one
exception is ``microbench``, which measures this machine and is called explicitly by the
plan stage (loading a cluster file never measures anything).
"""
