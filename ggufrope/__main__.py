"""``python -m ggufrope``: the ggufrope command line."""

from ggufrope.cli import main

if __name__ == "__main__":
    main(prog_name="ggufrope")
