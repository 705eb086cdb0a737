"""Role workers: thin glue between DataProto calls from the driver and the engines (train, rollout)."""
