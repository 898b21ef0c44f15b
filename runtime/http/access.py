"""Every route's class, declared where it is registered and enforced by the router it is registered on.

- `PUBLIC`: anyone may call it, key or not; it shows nothing of any tenant (`/health`, the cache page's static
  files, `/openapi.json`).
- `TENANT`: needs an API key whenever one is configured (401 otherwise); it acts only in the caller's own tenant and
  shows only the caller's own requests and cache (generation, abort, server info's tenant view, `/cache/tree`).
- `ADMIN`: acts on or shows every tenant (flushing the cache, loading adapters, metrics); needs a caller that may
  administer (runtime/tenancy.py: the admin key whenever one is set; with a tenants file and no admin key, nobody),
  else 403.

A route gets its class from `access_router(cls)`: an APIRouter whose route type carries the class and whose
dependency enforces it, so a handler on it cannot forget the check. `check_route_classes(app)` runs at the end of
`create_app` and refuses to build an app with a route that has no class (a route added with a bare APIRouter or
`app.add_api_route`), so a new route cannot go out unclassified. docs/security.md lists every route and its class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import APIRouter, Depends, FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.requests import Request

from radixserve.runtime.http.state import caller, caller_tenant, require_admin
from radixserve.runtime.tenancy import Caller


class Access(enum.Enum):
    PUBLIC = "public"
    TENANT = "tenant"
    ADMIN = "admin"


class UnclassifiedRouteError(RuntimeError):
    """The app has a route that declares no class (runtime/http/access.py)."""


def admin_caller(request: Request) -> Caller:
    """FastAPI dependency of the admin routes: the caller, or a 401 (bad key) or a 403 (not the administrator)."""
    who = caller(request)
    require_admin(who, request.url.path)
    return who


_ENFORCED_BY: dict[Access, list[Any]] = {
    Access.PUBLIC: [],
    Access.TENANT: [Depends(caller_tenant)],
    Access.ADMIN: [Depends(admin_caller)],
}
# One APIRoute type per class; FastAPI keeps a route's type when a router is included in the app.
_ROUTE_TYPES: dict[Access, type[APIRoute]] = {
    access: type(f"{access.name.title()}Route", (APIRoute,), {"access": access}) for access in Access
}


def access_router(access: Access, route_base: Optional[type[APIRoute]] = None, key_check: Optional[Any] = None,
                  **router_kwargs: Any) -> APIRouter:
    """An APIRouter whose routes all have class `access`, enforced by a dependency that runs before the handler
    (and before the body is read).

    `route_base` is a route type of the surface's own (for example one that answers errors in another envelope);
    `key_check` replaces the class's key dependency where a surface takes its key in another header (Anthropic's
    `x-api-key`): it must resolve the caller's tenant or refuse, as `caller_tenant` does."""
    enforced = _ENFORCED_BY[access] if key_check is None else [Depends(key_check)]
    dependencies = [*enforced, *router_kwargs.pop("dependencies", [])]
    route_class = _ROUTE_TYPES[access] if route_base is None else \
        type(f"{access.name.title()}{route_base.__name__}", (route_base,), {"access": access})
    return APIRouter(route_class=route_class, dependencies=dependencies, **router_kwargs)


def route_access(route: Any) -> Optional[Access]:
    """The class a route declares, or None."""
    access = getattr(route, "access", None)
    return access if isinstance(access, Access) else None


@dataclass(frozen=True)
class ServedRoute:
    path: str
    methods: frozenset[str]
    access: Optional[Access]


def served_routes(app: FastAPI) -> list[ServedRoute]:
    """Every route `app` serves, routers included in routers flattened, with the class it declares."""
    return [ServedRoute(str(context.path), frozenset(context.methods or ()), route_access(context.original_route))
            for context in iter_route_contexts(app.routes)]


def mark_openapi_public(app: FastAPI) -> None:
    """FastAPI adds `/openapi.json` itself (a plain Starlette route); the schema is public."""
    for route in app.routes:
        if getattr(route, "path", None) == app.openapi_url:
            route.access = Access.PUBLIC  # type: ignore[attr-defined]


def unclassified_routes(app: FastAPI) -> list[str]:
    """"METHODS path" of each route of `app` that declares no class."""
    return [f"{','.join(sorted(route.methods))} {route.path}" for route in served_routes(app) if route.access is None]


def check_route_classes(app: FastAPI) -> None:
    """Raise UnclassifiedRouteError unless every route of `app` declares its class."""
    missing = unclassified_routes(app)
    if missing:
        raise UnclassifiedRouteError(
            f"route(s) without a class (public, tenant or admin): {missing}; register them on "
            "access_router(Access.<class>) (runtime/http/access.py)")
