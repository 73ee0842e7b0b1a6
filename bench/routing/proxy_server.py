"""``python -m bench.routing.proxy_server``: the proxy's process (:func:`.proxy.main`), a
module of its own so the package, which imports :mod:`.proxy`, has not run it first."""

from bench.routing.proxy import main

main()
