"""dpcourse: the small library shared by the course's notebooks, labs and tests, in four layers by
who reads them (docs/design.md §2). Imports flow down only, and tests/test_layout.py holds it:

    dpcourse.kit       the course's machinery: make course, student, check
    dpcourse.cluster   cluster and room operations: Slurm, the hub, the doctor, gpu-check
    dpcourse.explore   what the notebooks use: launching labs, studies, explorers, plots
    dpcourse.lab       what a lab imports: world (who am I), data, models, the run log, checkpoints

(kit may import cluster; cluster never imports kit.)
"""
__version__ = "0.1.0"
