"""The argument checks and the reference math in torch (_checks), and the block-scaled formats'
checks, shapes and reference (_blockscale): shared by the operators, their fake implementations, the
torch fallbacks and the tests. Imports only ``ubnext.kernels`` (its flag constants)
(docs/ARCHITECTURE.md)."""
