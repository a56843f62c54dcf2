"""The pure core of gradientmail: the run's layout in the store and the numerics of a round.

No module of this package imports anyio, the mailbox or an event loop, and none does I/O or
reads a clock; the node moves bytes and time around them.
"""
