"""``partc calibrate``: measure this machine's devices.

It writes the profile a DeviceBudget loads.
"""
