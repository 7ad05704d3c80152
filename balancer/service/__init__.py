"""The live PD router service (``pdlb serve``): an aiohttp OpenAI-compatible proxy around
:class:`balancer.router.Router`. See :func:`balancer.service.app.create_app`."""
