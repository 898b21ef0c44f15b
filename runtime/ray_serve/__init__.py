"""Multi-node serving on Ray Serve (`pip install radixserve[ray]`; the public import is `radixserve.ray`).

    clients --HTTP--> Ray Serve proxy --> Ingress replica: radixserve's FastAPI app over an EngineProxy (proxy.py)
                                              |  handle calls; the router (router.py) runs in this process
                                              v
                                    EngineReplica x N (replica.py): one Engine each, placed and restarted by Ray

app.py builds the application (`build_app`, `app_builder` for config files, `radixserve serve-ray`); routing.py
holds the light types the ingress, the router and the replicas exchange. Nothing else in radixserve imports
this package, so Ray stays optional.
"""
