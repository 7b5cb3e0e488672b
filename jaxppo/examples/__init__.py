"""Examples of what a user brings to jaxppo, importable by path from a config (e.g.
`network: {module: "jaxppo.examples.networks:LayerNormActorCritic"}`)."""
