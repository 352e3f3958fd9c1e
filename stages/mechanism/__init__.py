"""The stage mechanism: how a stage is keyed, locked, attempted, published, tracked and launched.

Nothing here computes a stage's output, so no module of this package is part of any stage key's
code (``stages.mechanism.keys``): editing it reruns nothing."""
