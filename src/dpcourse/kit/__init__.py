"""The course's own machinery: ``make course``, ``make student`` and ``make check`` (``course``).

May import every other layer; nothing imports it.
"""
