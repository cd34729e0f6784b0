"""The devices planned for (torch-free up to the budget).

Presets by name, profiles measured by ``partc calibrate``, and the budget a user declares.
"""
