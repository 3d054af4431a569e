"""What the notebooks use: a lab run from a cell (``launch``), studies (``scaling``), explorers
(``widgets``, ``memory``) and plots drawn from the labs' logs (``plots``).

Imports ``dpcourse.lab`` and its own modules, never the course's machinery or cluster operations.
"""
