"""End-to-end tests; a package so that the private Ray its deployments share
(conftest.deployment_ray) ends with the folder."""
