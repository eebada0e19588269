"""Framework integrations over zero_ext's public API, each imported explicitly so that
`import zero_ext` never imports a framework (docs/integrations.md):

    import zero_ext.integrations.lightning     # Trainer(strategy="zero_ext_stage3")
    from zero_ext.integrations.hf import ZeroTrainer
    from zero_ext.integrations.accelerate import prepare
"""
