"""The demo and the real material it runs on.

- `run`: `tunelab demo`, every stage of the protocol as the user would type it
- `studies`: the demo's two study configs (classification, extraction)
- `data`: example data sets built from the packaged assets (`python -m tunelab.demo.data`)
- `assets`: where the packaged real models and data sets live (`asset:NAME` in a config)

- `images`: the image demo's digits and ViT (`write_digits(folder)`, `write_vit(folder)`,
  `python -m tunelab.demo.images DIR`)
"""
