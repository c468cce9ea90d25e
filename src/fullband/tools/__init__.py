"""Commands built on top of the library, not part of it: ``fullband demo`` (a small transformer and a small FBT
trained and compared on the CPU) and the analysis tools ``fullband probe`` (linear probes of a task's running state)
and ``fullband jacobi`` (per-pass loss and change of the Jacobi iteration). Only the command line imports them."""
