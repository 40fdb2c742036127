"""A shard specification to a split every replica can plan from, once per job before spawning.

Who may count missing counts is the caller's to say (``SplitOptions.counting_host``):
on a pod, launch/ lets host 0 count and makes the others wait for its index.
"""
