"""Tools that measure first and then decide: size parsing, plan, monitor, explain.

The measuring tools of the first wave (``memkernels.profile``, ``memkernels.estimate``)
join this package as they are next changed.
"""
