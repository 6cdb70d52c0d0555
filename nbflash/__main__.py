"""``python -m nbflash``: the demo (see :mod:`nbflash.demo`)."""

from .demo import main

main()
