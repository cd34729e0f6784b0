"""``partc calibrate``: measure this machine's devices and write the profile a DeviceBudget loads."""
