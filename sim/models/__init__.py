"""What is simulated: model specs (:mod:`sim.models.spec`), presets (:mod:`sim.models.presets`), Hugging Face configs (:mod:`sim.models.hf`), DeepSeek CSA2 geometry and GPU datasheets."""
