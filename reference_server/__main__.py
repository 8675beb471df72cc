"""``python -m reference_server`` — the same command as ``paasbench serve`` (:mod:`paasbench.commands.serve`)."""

from paasbench.commands.serve import serve

if __name__ == "__main__":
    serve(prog_name="python -m reference_server")
