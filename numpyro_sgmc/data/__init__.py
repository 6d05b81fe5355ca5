"""The model and its data: what every kernel and the tuner read (``docs/architecture.md``).

Owns the prepared model (:mod:`~numpyro_sgmc.data.model`: the potential over flat parameters,
the plates and their sizes, constraints, the start) and its first trace
(:mod:`~numpyro_sgmc.data.first_trace`: the sites and plates, and their checks), the checks
of user input (:mod:`~numpyro_sgmc.data.validation`), the data plate's subsampling
(:mod:`~numpyro_sgmc.data.subsample`) and batch samplers (:mod:`~numpyro_sgmc.data.batches`),
file-backed arguments (:mod:`~numpyro_sgmc.data.files`, :mod:`~numpyro_sgmc.data.streaming`),
full-data passes (:mod:`~numpyro_sgmc.data.passes`),
the gradient estimators (:mod:`~numpyro_sgmc.data.gradients`) and their data-parallel form
(:mod:`~numpyro_sgmc.data.sharding`), and the host-side progress bar and Ctrl-C handling
(:mod:`~numpyro_sgmc.data.progress`). It may import the foundations only
(:mod:`numpyro_sgmc.scales`, :mod:`numpyro_sgmc.diagnostics`, :mod:`numpyro_sgmc.host`,
:mod:`numpyro_sgmc.compilation`): nothing here knows a kernel, the tuner or the theory.
"""
