"""Commands built on top of the library, not part of it: ``fullband demo``, ``probe`` and ``jacobi``. Only the
command line imports them."""
