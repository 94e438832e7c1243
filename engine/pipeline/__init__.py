"""Pipeline parallelism: the model's layers split across several devices, one process per device.

split.py    which layers each device holds (contiguous stages balanced by planned bytes; pure)
naming.py   a stage model's module names: local and global layer numbers, what a stage holds (pure)
devices.py  the device list (`cuda:0,cuda:1`, or `cpu,cpu` for two CPU processes) checked before loading
protocol.py the small command each step sends to every stage, and the tensors that follow it
stage.py    one stage's model part, KV cache and (on a GPU) fused decode step
launch.py   starting the worker processes and torch.distributed, and ending them
worker.py   the loop of every rank but 0 (`python -m engine.pipeline.worker`)
runner.py   PipelineRunner: ModelRunner's interface on rank 0 (the driver, also stage 0)
setup.py    from run options to a running pipeline: stages planned and checked per device, then started
"""
