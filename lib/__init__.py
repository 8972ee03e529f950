"""The library the commands stand on: checkpoints, data, options, devices, processes, runs,
tokenizers."""
