"""Dependencies the routers share, as named Annotated types."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from adaserve.contract.slo import CLASS_NAME
from adaserve.gateway.service import Gateway


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
SloClassHeader = Annotated[str | None, Header(alias="X-SLO-Class", pattern=CLASS_NAME.pattern)]
AuthorizationHeader = Annotated[str | None, Header(alias="Authorization")]
