"""The cost model: integer time and memory tables for one pipeline configuration.

The planner (CP-SAT), the brute-force oracle in the tests, the validator and the report all
read the same :class:`~partc.cost.tables.CostTable`, built deterministically
(:func:`~partc.cost.tables.build_cost_table`) from a :class:`~partc.problem.PlanningProblem`
and a :class:`~partc.cost.pipeline_config.PipelineConfig`. Times are integers in
picoseconds and memory in bytes, so the solver's objective and an independent evaluation of
a plan (:func:`~partc.cost.evaluate.evaluate`) agree exactly.

The modules, each one concern: :mod:`.pipeline_config` (the configuration and what follows
from it, the tables' units), :mod:`.layer_compute` (a layer's compute per microbatch),
:mod:`.state_bytes` (what a rank holds of its parameters), :mod:`.collectives` (one
collective or send over a group's link), :mod:`.communication` (ZeRO's, tensor-parallel and
pipeline traffic, the step's tail), :mod:`.experts_cost` (expert parallelism's figures), :mod:`.cp_attention` (context
parallelism: a rank's share of each sequence, the exchange around each attention core),
:mod:`.offload_time` (a
layer's saved activations on the host: the copies' exposed time, their window, the host
bytes),
:mod:`.tables` (the rows, their cache and the table), :mod:`.row_parts` (a row's
compute and its parameters' figures, each priced once for the configurations that share
it), :mod:`.evaluate` (an assignment's
time and memory, the step in closed form and played out), :mod:`.schedules` (the
schedules' facts) and :mod:`.timeline` (one step played out per rank).

Model (per pipeline stage ``s`` of ``p``, ``m`` microbatches of ``b`` samples):

- compute per microbatch, per layer and recompute mode: forward, backward and the recomputed
  forward, summed op by op. A compute-heavy op (matmul, attention) takes its roofline
  ``max(b * flops / (peak * efficiency), (b * activation bytes + weight bytes) / HBM
  bandwidth)``: its weight is read once per microbatch, so small microbatches (decode-like
  shapes) are bound by memory and large ones by FLOPs; ``efficiency`` is one factor per
  device type (presets, calibration), and a fused attention kernel has its own
  (``DeviceNumbers.attention_efficiency``: flash kernels run below the matmuls). Every other
  op moves its bytes at the device's element-wise rate
  (``DeviceNumbers.elementwise_bandwidth``: 0.75 of HBM bandwidth in the Hopper presets,
  HBM's in the A100s', unless calibrated; a CPU thread runs them well below its copy rate),
  autocast's casts among them. Every op also pays a fixed overhead per call and microbatch,
  and every heavy op a fixed time beyond its FLOPs (``DeviceNumbers.op_overhead_s``,
  ``matmul_overhead_s``): more, smaller microbatches cost more. On a GPU, whose host
  dispatches ahead of its kernels, the ops' overhead is a floor under each layer's phase
  rather than a sum (:func:`~partc.cost.layer_compute.dispatched`); the GPU's own time per
  kernel, whatever its size (``DeviceNumbers.kernel_overhead_s``), adds to it for each
  kernel the estimate counted the layer launching (``LayerCost.kernels``) and each
  gradient's add into its accumulator. A heavy op's backward is twice its forward (its
  gradients w.r.t. its input and its weight are two ops like it; a fused attention kernel's
  recomputed scores add FLOPs); the light ops' backward moves the bytes the estimate
  measured autograd's ops to move (``LayerCost.bwd_mem_bytes``); recompute replays its ops
  at the same roofline (:func:`~partc.cost.layer_compute.layer_work`). Sequence-parallel
  linears that run as rings (``TrainSpec.tp_overlap``) add the kernels and bytes the
  estimate measured their rings to add to the blocking program it runs
  (:func:`~partc.cost.layer_compute.run_layer`);
- ``t_s`` = compute of the stage's layers + its end's share of the transfers across its
  cuts (the activation forward, its gradient backward, over the link to the next stage):
  all but ``comm_overlap`` of each, sender and receiver alike
  (:func:`~partc.cost.evaluate.end_share_ps`); the transfer itself delays the stage that
  waits for it, one at a time over each link, which the simulation plays;
- pipeline time, in closed form for the planner's search: ``(m - 1) * max_s t_s + sum_s
  t_s``: every microbatch passes the bottleneck stage, and the first one passes every stage
  once (GPipe and 1F1B alike); under a zero-bubble schedule, which runs a layer's backward
  as an input-gradient then a weight-gradient pass, its backward compute costs
  ``DeviceNumbers.split_backward_factor`` times one pass
  (:func:`~partc.cost.pipeline_config.split_factor`); with ``v`` virtual stages per rank
  (placed as the schedule places them, :mod:`partc.cost.schedules`; ``t_s`` sums them) the
  fill-and-drain term is divided by ``v``, and by 3 more under a zero-bubble schedule
  (:attr:`~partc.cost.pipeline_config.PipelineConfig.fill_divisor`). The step time a plan
  reports is the schedule played out in its own order
  (:func:`~partc.cost.evaluate.simulate`, :mod:`partc.cost.timeline`);
- collectives and sends by :mod:`partc.cost.collectives` (alpha-beta, ring or tree as NCCL
  picks, over NVLink inside a node and the network across; inside a node each kind by
  its own calibrated link where the profile has one), in the dtypes the runtime moves
  them in: sends and tensor-parallel collectives as ``estimate`` measured the values
  (under autocast the residual stream and norm outputs fp32, matmul outputs bf16),
  gradients reduced in fp32, ZeRO-2/3 weights gathered in the compute dtype;
- after the pipeline drains, ``max_s e_s`` where ``e_s`` is the exposed part of the
  data-parallel gradient all-reduce (ring; each gradient's all-reduce starts as soon as the
  last microbatch's backward has accumulated it, so ``max(0, all-reduce - that backward)``
  is left with one virtual stage per rank; with several, each stage's share starts at its
  own last backward and the rank's backwards after it hide it too, as the schedule's order
  places them: :func:`~partc.cost.timeline.overlap_windows`) plus the optimizer step of the stage's parameters (the bytes a step touches,
  :attr:`~partc.problem.Precision.step_bytes`, at ``DeviceNumbers.optimizer_bandwidth``: HBM
  bandwidth unless calibrated), and the all-reduce of tied parameters' gradients among the
  stages that hold them;
- ZeRO-2/3 (FSDP2, one unit per layer): every microbatch's backward reduce-scatters the
  layer's gradients, and ZeRO-3 gathers its parameters in forward and again in backward;
  each collective overlaps the layer's own compute (a layer costs ``max(compute, comm)`` per
  phase, as FSDP prefetches the next unit while one computes); ZeRO-2 gathers all parameters
  once per step, in the tail. ZeRO-2 with ``zero2_grad_sync`` "step" and several
  microbatches accumulates whole fp32 gradients instead (memory as ZeRO-1's) and
  reduce-scatters them once, in the last microbatch's backward: priced as ZeRO 0/1's
  reduction, exposed after the pipeline drains where that backward does not hide it. FSDP's
  own work on the unit beside its collectives, which no collective hides
  (:func:`~partc.cost.communication.zero_overhead_seconds`): its hooks every microbatch,
  forward and backward, per all-gather and reduce-scatter the copies in and out
  (``fsdp_copy_bandwidth``, else HBM bandwidth) and the fixed work of each, and the
  optimizer step's dispatch per sharded tensor (``DeviceNumbers.fsdp_*_overhead_s``: a
  CPU's, calibrated; 0 on a GPU, whose host runs ahead of its kernels);
- memory of stage ``s``: parameters + gradients + optimizer state of every parameter the
  stage uses (a tied parameter on every stage that uses it) + saved activations times the
  microbatches in flight (1F1B: ``min(m, p - s)``; GPipe: ``m``; the others counted per run
  from the schedule's order, the largest over its peaks,
  :meth:`~partc.cost.pipeline_config.PipelineConfig.held`: interleaved 1F1B holds a rank's
  first run more often than its later ones) + the largest transient working set of one layer
  (for a recomputed layer: what recompute rematerialises; under ZeRO-2/3 what FSDP holds of
  the layer's unit, :func:`~partc.cost.state_bytes.zero_transient`) + the pipeline's receive
  buffers (:func:`~partc.cost.evaluate.receive_bytes`): the gradient crossing the cut after
  each of the stage's runs, for the backward being run (the activations received are the
  first layer's saved inputs, among the activations).
"""
