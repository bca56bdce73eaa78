"""``python -m hookscope``: the command line."""

from .show import main

if __name__ == "__main__":
    main()
