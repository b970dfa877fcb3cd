"""Drives markov-server through a client generated from its own OpenAPI
document: sessions, a message streamed as server-sent events, the call it
waits on approved, a second decision refused, cancel, the events of a
finished run replayed with Last-Event-ID, and a browser's sign-in with a
key. Every answer is checked against the document: its status is one the
operation documents, its body parses into the generated model, and every
event fits the documented event schema.

Usage: client.py BASE_URL KEY GENERATED_DIR DOCUMENT
(GENERATED_DIR holds the generated package `markov_client`).
Prints OK at the end; any failure is an exception or a FAILED line.
"""

import json
import re
import sys

import jsonschema
from openapi_spec_validator import validate

base, key, generated, document_path = sys.argv[1:5]
sys.path.insert(0, generated)

from markov_client import AuthenticatedClient, Client  # noqa: E402
from markov_client.api.approvals import approvals, decide  # noqa: E402
from markov_client.api.identity import me, sign_in, sign_out  # noqa: E402
from markov_client.api.runs import cancel, events  # noqa: E402
from markov_client.api.service import health, metrics, openapi  # noqa: E402
from markov_client.api.sessions import (  # noqa: E402
    agents,
    command,
    create_default,
    create_for,
    list_all,
    list_for,
    show,
)
from markov_client.models import (  # noqa: E402
    AgentInfo,
    ApprovalRequest,
    Cancelling,
    CommandRequest,
    CommandResult,
    DecisionBody,
    ErrorBody,
    Health,
    Me,
    NewSession,
    SessionDetail,
    SessionSummary,
    SignIn,
    UserText,
)

with open(document_path, encoding="utf-8") as f:
    document = json.load(f)
validate(document)

events_schema = {
    "$ref": "#/components/schemas/RunEvent",
    "components": document["components"],
}
event_validator = jsonschema.Draft202012Validator(events_schema)


def check(condition, what):
    if not condition:
        print(f"FAILED: {what}")
        sys.exit(1)


def documented(method, path, response):
    """The status is one the document lists for the operation."""
    operation = document["paths"][path][method]
    status = str(response.status_code)
    if status not in operation["responses"]:
        body = response.read()[:300]
        check(
            False,
            f"{method.upper()} {path} answered {status}, which it does not document "
            f"({sorted(operation['responses'])}): {body!r}",
        )
    return response


anonymous = Client(base_url=base)
alice = AuthenticatedClient(base_url=base, token=key)

# --- the service and identity ----------------------------------------------------
r = documented("get", "/healthz", health.sync_detailed(client=anonymous))
check(r.status_code == 200 and isinstance(r.parsed, Health), f"healthz: {r}")
check(r.parsed.status == "ok", "healthz says ok")

r = documented("get", "/me", me.sync_detailed(client=alice))
check(isinstance(r.parsed, Me) and r.parsed.principal == "alice", f"me: {r.parsed}")
check("approver" in r.parsed.roles, "alice approves")
r = documented("get", "/me", me.sync_detailed(client=anonymous))
check(r.status_code == 401 and isinstance(r.parsed, ErrorBody), "me without a key")

r = documented("get", "/openapi.json", openapi.sync_detailed(client=alice))
check(r.status_code == 200 and json.loads(r.content) == document, "the document served")
r = documented("get", "/metrics", metrics.sync_detailed(client=alice))
check(r.status_code == 200 and b"# EOF" in r.content, "metrics")

# --- agents and sessions ------------------------------------------------------
r = documented("get", "/agents", agents.sync_detailed(client=alice))
check(isinstance(r.parsed, list) and all(isinstance(a, AgentInfo) for a in r.parsed), "agents")
check([(a.name, a.default) for a in r.parsed] == [("payments", True)], f"agents: {r.parsed}")

r = documented("post", "/sessions", create_default.sync_detailed(client=alice))
check(r.status_code == 201 and isinstance(r.parsed, NewSession), f"create: {r}")
session = r.parsed.id
check(r.parsed.agent == "payments", "the default agent's session")
r = documented(
    "post", "/agents/{agent}/sessions", create_for.sync_detailed("payments", client=alice)
)
check(r.status_code == 201 and isinstance(r.parsed, NewSession), "create for an agent")
other = r.parsed.id
r = documented(
    "post", "/agents/{agent}/sessions", create_for.sync_detailed("nobody", client=alice)
)
check(r.status_code == 404 and isinstance(r.parsed, ErrorBody), "no such agent")

r = documented("get", "/sessions", list_all.sync_detailed(client=alice))
check(all(isinstance(s, SessionSummary) for s in r.parsed), "session summaries")
check({session, other} <= {s.id for s in r.parsed}, "both sessions listed")
r = documented(
    "get", "/agents/{agent}/sessions", list_for.sync_detailed("payments", client=alice)
)
check({session, other} <= {s.id for s in r.parsed}, "listed by agent")
r = documented("get", "/sessions/{id}", show.sync_detailed("nope", client=alice))
check(r.status_code == 404 and isinstance(r.parsed, ErrorBody), "no such session")

r = documented(
    "post",
    "/sessions/{id}/commands",
    command.sync_detailed(session, client=alice, body=CommandRequest(name="no-such-command")),
)
check(isinstance(r.parsed, (CommandResult, ErrorBody)), f"a command's answer is typed: {r}")

# --- runs as server-sent events -------------------------------------------------
http = alice.get_httpx_client()
EVENT_ID = re.compile(r"^\d+-\d+$")


def read_events(lines):
    """The server-sent events of `lines`: dicts of id, event and data."""
    out, current = [], {}
    for line in lines:
        if line == "":
            if "event" in current:
                out.append(current)
            current = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                current["data"] = current.get("data", "") + value
            else:
                current[field] = value
    if "event" in current:
        out.append(current)
    for event in out:
        check(EVENT_ID.match(event.get("id", "")), f"an event id: {event}")
        event["data"] = json.loads(event["data"])
        errors = list(event_validator.iter_errors({"event": event["event"], "data": event["data"]}))
        check(not errors, f"the {event['event']} event fits the document: {errors[:1]}")
    return out


def stream(method, path, route, **kwargs):
    with http.stream(method, path, **kwargs) as response:
        documented(method.lower(), route, response)
        check(response.status_code == 200, f"{method} {path}: {response.status_code}")
        check(
            response.headers["content-type"].startswith("text/event-stream"),
            f"{path} streams events",
        )
        return read_events(response.iter_lines())


turn = stream(
    "POST",
    f"/sessions/{session}/messages",
    "/sessions/{id}/messages",
    json=UserText(text="pay 5").to_dict(),
)
names = [e["event"] for e in turn]
check(names[-1] == "done" and "step" in names, f"a turn's events: {names}")
check(turn[-1]["data"]["awaiting_approval"] is True, "the turn waits for approval")

r = documented("get", "/sessions/{id}/approvals", approvals.sync_detailed(session, client=alice))
check(len(r.parsed) == 1 and isinstance(r.parsed[0], ApprovalRequest), f"pending: {r.parsed}")
request = r.parsed[0]
check(request.tool == "pay" and request.args.to_dict() == {"amount": 5}, "the call waits")
r = documented("get", "/sessions/{id}", show.sync_detailed(session, client=alice))
check(isinstance(r.parsed, SessionDetail), "a session, typed")
check(r.parsed.awaiting_approval is True, "the session waits")
check([p.request_id for p in r.parsed.pending_approvals] == [request.request_id], "its request")

decided = stream(
    "POST",
    f"/sessions/{session}/approvals/{request.request_id}",
    "/sessions/{id}/approvals/{request}",
    json=DecisionBody(decision="approve").to_dict(),
)
names = [e["event"] for e in decided]
check(names[0] == "decided" and names[-1] == "done", f"a decision's events: {names}")
check(decided[-1]["data"]["done"] is True, "the turn is over")
check("Paid 5." in json.dumps(decided), "the answer streams")
r = documented(
    "post",
    "/sessions/{id}/approvals/{request}",
    decide.sync_detailed(
        session, request.request_id, client=alice, body=DecisionBody(decision="approve")
    ),
)
check(r.status_code == 409 and isinstance(r.parsed, ErrorBody), f"decided twice: {r}")
check("already" in r.parsed.error, r.parsed.error)

# The run is over: nothing to follow, unless a client asks for what it
# missed.
r = documented("get", "/sessions/{id}/events", events.sync_detailed(session, client=alice))
check(r.status_code == 204, f"no run in progress: {r.status_code}")
run = decided[0]["id"].split("-")[0]
replayed = stream(
    "GET",
    f"/sessions/{session}/events",
    "/sessions/{id}/events",
    headers={"last-event-id": f"{run}-0"},
)
check(
    [e["id"] for e in replayed] == [e["id"] for e in decided],
    f"the replay is the run: {[e['id'] for e in replayed]} {[e['id'] for e in decided]}",
)
replayed = stream(
    "GET",
    f"/sessions/{session}/events",
    "/sessions/{id}/events",
    headers={"last-event-id": decided[0]["id"]},
)
check([e["id"] for e in replayed] == [e["id"] for e in decided[1:]], "what followed an id")

# Cancel a turn in progress (the model takes its time).
with http.stream(
    "POST", f"/sessions/{session}/messages", json=UserText(text="and again").to_dict()
) as response:
    documented("post", "/sessions/{id}/messages", response)
    check(response.status_code == 200, f"a second turn: {response.status_code}")
    r = documented("post", "/sessions/{id}/cancel", cancel.sync_detailed(session, client=alice))
    check(r.status_code == 202 and isinstance(r.parsed, Cancelling), f"cancel: {r}")
    cancelled = read_events(response.iter_lines())
check(cancelled[-1]["event"] == "done", f"the cancelled turn ends: {cancelled}")
check(cancelled[-1]["data"]["stopped"] == "cancelled", f"stopped: {cancelled[-1]}")
r = documented("post", "/sessions/{id}/cancel", cancel.sync_detailed(session, client=alice))
check(r.status_code == 409 and isinstance(r.parsed, ErrorBody), "nothing left to cancel")

# --- the studio: the session's recorded steps, a step's request, a fork -------
from markov_client.api.studio import fork, replay, step_request, steps  # noqa: E402
from markov_client.models import Fork, Replay, StepPage, StepRequest  # noqa: E402

r = documented("get", "/sessions/{id}/steps", steps.sync_detailed(session, client=alice, limit=1))
check(isinstance(r.parsed, StepPage) and len(r.parsed.steps) == 1, f"a page of steps: {r}")
check(r.parsed.steps[0].index == 0, "the first step")
check(r.parsed.to_dict().get("next") == 1, f"another page follows: {r.parsed.to_dict()}")
r = documented("get", "/sessions/{id}/steps", steps.sync_detailed(session, client=alice, limit=0))
check(r.status_code == 400 and isinstance(r.parsed, ErrorBody), "a page of none")
r = documented("get", "/sessions/{id}/steps", steps.sync_detailed(session, client=anonymous))
check(r.status_code == 401, "no steps without a key")
r = documented("get", "/sessions/{id}/steps", steps.sync_detailed(session, client=alice))
asked = next(s.index for s in r.parsed.steps if s.has_request)
steps_replayable = r.parsed.replayable
r = documented(
    "get",
    "/sessions/{id}/steps/{n}/request",
    step_request.sync_detailed(session, asked, client=alice),
)
check(isinstance(r.parsed, StepRequest), f"a step's request: {r}")
check(r.parsed.request.to_dict()["system"] == "You pay bills.", "the system prompt sent")
r = documented(
    "get", "/sessions/{id}/steps/{n}/request", step_request.sync_detailed(session, 99, client=alice)
)
check(r.status_code == 404 and isinstance(r.parsed, ErrorBody), "no step 99")
r = documented(
    "post",
    "/sessions/{id}/steps/{n}/fork",
    fork.sync_detailed(session, 99, client=alice, body=Fork()),
)
check(r.status_code == 404 and isinstance(r.parsed, ErrorBody), f"no step 99 to fork: {r}")
check(steps_replayable is False, "this server replays nothing")
r = documented(
    "post", "/sessions/{id}/replay", replay.sync_detailed(session, client=alice, body=Replay())
)
check(r.status_code == 409 and isinstance(r.parsed, ErrorBody), f"not replayable: {r}")

# --- a browser's sign-in with a key ---------------------------------------------
r = documented(
    "post", "/auth/session", sign_in.sync_detailed(client=anonymous, body=SignIn(key="mk_0_x"))
)
check(r.status_code == 401 and isinstance(r.parsed, ErrorBody), "not a key")
r = documented("post", "/auth/session", sign_in.sync_detailed(client=anonymous, body=SignIn(key=key)))
check(r.status_code == 204, f"signed in: {r.status_code}")
cookie = r.headers["set-cookie"].split(";")[0].split("=", 1)[1]
browser = Client(base_url=base, cookies={"markov_session": cookie})
r = documented("get", "/me", me.sync_detailed(client=browser))
check(isinstance(r.parsed, Me) and r.parsed.principal == "alice", "the cookie signs in")
r = documented("delete", "/auth/session", sign_out.sync_detailed(client=browser))
check(r.status_code == 204, "signed out")
replay = Client(base_url=base, cookies={"markov_session": cookie})
r = documented("get", "/me", me.sync_detailed(client=replay))
check(r.status_code == 401, "the signed-out cookie signs nobody in")

print("OK")
