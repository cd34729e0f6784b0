"""The devices planned for: presets by name, profiles measured by ``partc calibrate``, and the budget a user declares (torch-free up to the budget)."""
