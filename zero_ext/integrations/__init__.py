"""Framework integrations: thin adapters over zero_ext's public API (zeroify, save, load).

Each one is imported explicitly, so that `import zero_ext` never imports a framework:

    import zero_ext.integrations.lightning     # Trainer(strategy="zero_ext_stage3")
    from zero_ext.integrations.hf import ZeroTrainer
    from zero_ext.integrations.accelerate import prepare

See docs/integrations.md.
"""
