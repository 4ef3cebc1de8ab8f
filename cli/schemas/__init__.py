"""The JSON Schemas of the command line's reports (``*.schema.json``), shipped as package
data: a package of their own so the build lists it, and every wheel carries them."""
