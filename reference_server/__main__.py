"""``python -m reference_server`` — the same command as ``paasbench serve`` (:mod:`reference_server.cli`), without
importing the harness."""

from reference_server.cli import serve

if __name__ == "__main__":
    serve(prog_name="python -m reference_server")
