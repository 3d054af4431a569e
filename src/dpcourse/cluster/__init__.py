"""Cluster and room operations, for a site's support team and the instructor: the Slurm templates
(``slurm``) and a real local Slurm (``localslurm``), the room's hub and spawner (``hub``,
``hubspawner``), its live view (``room``), the doctor and ``make gpu-check`` (``gpucheck``).

Imports ``dpcourse.lab`` and ``dpcourse.explore``, never the course's machinery.
"""
