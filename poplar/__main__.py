"""``python -m poplar``: the same command line as ``poplar``."""

from poplar.cli.main import app

if __name__ == "__main__":
    app(prog_name="poplar")
