"""The cost model: what a pipeline configuration costs in time and memory, collectives over the links a group uses, the schedules' facts, and one step played out on a timeline."""
