"""The AdaServeDeployment operator (kopf): renders a resource into Deployments, Services and a ConfigMap.

Layout: ``spec`` parses and re-validates the resource, ``builders`` renders the children (pure), ``status``
turns what the children and the workers' Redis registrations say into the resource's status (pure),
``kube`` and ``registrations`` are the only I/O, ``handlers`` wires them to kopf.
Names, labels and environment variables follow docs/k8s-contract.md. Nothing here imports torch.
"""
