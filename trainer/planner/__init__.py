"""The layerwise strategy planner (Galvatron's search): measure blocks and collectives once per GPU type
(`profile`), predict a strategy's step time and memory from the measurements (`cost`), and search per-block
sharding and checkpointing, tensor parallel and the pipeline under a memory budget (`search`)."""
