"""A forked child that becomes a new `python3 SCRIPT ARGS` process, for the servers that fork runs from a process that
has already imported torch: the tests' zygote (tests/launcher.py) and the tiny bench's row server
(scripts/bench/bench_gpu.py). A module, not run by itself; both load it from its file (importlib), so that the forked
children's sys.path stays a new process's."""
from __future__ import annotations

import os
import signal
import sys

# Variables that a library reads when it is imported, or the interpreter when it starts: a forked child keeps its
# server's values, so a run that sets another value needs a server started with it, or a new process.
IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS", "GOTO", "ATEN_", "ONEDNN_", "DNNL_", "TORCH",
                        "PYTORCH", "TRITON", "CUDA", "NCCL", "NVIDIA", "PYTHON", "LD_", "MALLOC", "NUMEXPR", "XLA",
                        "KINETO")


def become(argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int], code) -> None:
    """In a forked child: become what `python3 ARGV` (a script's path, or "-c" and its code) is at its first line and
    run `code` (ARGV's, compiled) as `__main__`; never returns. Its stdin, stdout and stderr are `fds` (closed after),
    its environment exactly `env` (os.environ replaced: C's getenv sees it too), its folder `cwd`, sys.argv and
    sys.path[0] as the interpreter sets them, a process group of its own, and fresh seeds for Python's `random`,
    NumPy's and torch's global generators (where imported), as a new interpreter draws them from the OS. It ends as
    the interpreter ends: SystemExit's status (its message on stderr), 1 and the traceback without this frame for an
    uncaught exception (SIGINT for KeyboardInterrupt), non-daemon threads joined, atexit handlers run, streams
    flushed."""
    import atexit
    import random
    import threading
    import traceback
    import types

    status = 1
    try:
        os.setpgid(0, 0)
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        random.seed()
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        if "torch" in sys.modules:
            sys.modules["torch"].default_generator.seed()
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        if argv[0] == "-c":
            sys.argv = list(argv[1:])
            sys.argv[0] = "-c"
            sys.path[0] = ""
        else:
            path = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(path))
            main.__file__ = path
            main.__cached__ = None
        sys.modules["__main__"] = main
        try:
            exec(code, main.__dict__)
            status = 0
        except SystemExit as e:
            status = exit_status(e)
        except BaseException as e:  # reported as the interpreter reports it: sys.excepthook, without this frame
            e = e.with_traceback(e.__traceback__.tb_next)
            sys.excepthook(type(e), e, e.__traceback__)
            status = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
        try:
            threading._shutdown()
        except BaseException:
            pass
        atexit._run_exitfuncs()
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    if status < 0:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


def exit_status(e: SystemExit) -> int:
    """The interpreter's exit status for an uncaught SystemExit (a message is printed to stderr, status 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1

