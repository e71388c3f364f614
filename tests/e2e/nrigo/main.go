// Command nrigo drives an NRI plugin with NRI's own runtime-side code
// (github.com/containerd/nri pkg/adaptation, the code containerd and CRI-O
// link), built offline in GOPATH mode from Debian's
// golang-github-containerd-nri-dev.  tests/e2e/test_nri_go.py runs it to check
// hostpid's plugin against the reference implementation of the protocol:
// registration and Configure over the multiplexed ttrpc connection,
// Synchronize, and CreateContainer answers merged the way a runtime merges
// them.
//
// Input (stdin, JSON): {"socket": PATH, "plugins": N, "waitSeconds": S,
// "synchronize": {"pods": [...], "containers": [...]},
// "cases": [{"pod": {...}, "container": {...}}], "repeat": R}; pods and
// containers in NRI's protobuf JSON form (protojson field names).
//
// Output (stdout): a line {"listening": PATH} once the socket is listened on
// (the test starts the plugin then), then one JSON document: the plugins'
// synchronize updates, and for each case the merged CreateContainerResponse
// (protojson) or the error, with the round trip's duration; with "repeat",
// the round-trip durations of R calls of the first case, for the benchmark.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sync"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	"google.golang.org/protobuf/encoding/protojson"
)

type request struct {
	Socket      string            `json:"socket"`
	Plugins     int               `json:"plugins"`
	WaitSeconds float64           `json:"waitSeconds"`
	Sync        *syncState        `json:"synchronize"`
	Cases       []json.RawMessage `json:"cases"`
	Repeat      int               `json:"repeat"`
}

type syncState struct {
	Pods       []json.RawMessage `json:"pods"`
	Containers []json.RawMessage `json:"containers"`
}

type caseInput struct {
	Pod       json.RawMessage `json:"pod"`
	Container json.RawMessage `json:"container"`
}

type caseAnswer struct {
	Response json.RawMessage `json:"response"`
	Error    string          `json:"error"`
	Seconds  float64         `json:"seconds"`
}

type answer struct {
	Synchronized  bool              `json:"synchronized"`
	SyncUpdates   []json.RawMessage `json:"syncUpdates"`
	SyncError     string            `json:"syncError"`
	Cases         []caseAnswer      `json:"cases"`
	RepeatSeconds []float64         `json:"repeatSeconds"`
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "nrigo: "+format+"\n", args...)
	os.Exit(2)
}

func pluginCount(r *adaptation.Adaptation) int {
	// The adaptation keeps its connected plugins unexported; the count is
	// read under its own lock (it embeds sync.Mutex) so that a case is sent
	// only once the plugin is in the list CreateContainer walks (it is added
	// just after Synchronize returns, on the accepting goroutine).
	r.Lock()
	defer r.Unlock()
	return reflect.ValueOf(r).Elem().FieldByName("plugins").Len()
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fail("bad request: %v", err)
	}
	if req.WaitSeconds == 0 {
		req.WaitSeconds = 30
	}
	unmarshal := protojson.UnmarshalOptions{DiscardUnknown: false}
	marshal := protojson.MarshalOptions{UseProtoNames: true}

	var pods []*api.PodSandbox
	var containers []*api.Container
	if req.Sync != nil {
		for _, raw := range req.Sync.Pods {
			pod := &api.PodSandbox{}
			if err := unmarshal.Unmarshal(raw, pod); err != nil {
				fail("bad pod: %v", err)
			}
			pods = append(pods, pod)
		}
		for _, raw := range req.Sync.Containers {
			ctr := &api.Container{}
			if err := unmarshal.Unmarshal(raw, ctr); err != nil {
				fail("bad container: %v", err)
			}
			containers = append(containers, ctr)
		}
	}
	var cases []*api.CreateContainerRequest
	for _, raw := range req.Cases {
		var c caseInput
		if err := json.Unmarshal(raw, &c); err != nil {
			fail("bad case: %v", err)
		}
		pod, ctr := &api.PodSandbox{}, &api.Container{}
		if err := unmarshal.Unmarshal(c.Pod, pod); err != nil {
			fail("bad case pod: %v", err)
		}
		if err := unmarshal.Unmarshal(c.Container, ctr); err != nil {
			fail("bad case container: %v", err)
		}
		cases = append(cases, &api.CreateContainerRequest{Pod: pod, Container: ctr})
	}

	var out answer
	var mu sync.Mutex
	syncFn := func(ctx context.Context, cb adaptation.SyncCB) error {
		updates, err := cb(ctx, pods, containers)
		mu.Lock()
		defer mu.Unlock()
		out.Synchronized = true
		if err != nil {
			out.SyncError = err.Error()
		}
		for _, u := range updates {
			text, _ := marshal.Marshal(u)
			out.SyncUpdates = append(out.SyncUpdates, text)
		}
		return err
	}
	updateFn := func(ctx context.Context, updates []*adaptation.ContainerUpdate) ([]*adaptation.ContainerUpdate, error) {
		// An unsolicited update is refused: the plugin has none to make.
		return updates, fmt.Errorf("nrigo: unsolicited update refused")
	}
	empty, err := os.MkdirTemp("", "nrigo-")
	if err != nil {
		fail("%v", err)
	}
	defer os.RemoveAll(empty)
	r, err := adaptation.New("nrigo", "0.1", syncFn, updateFn,
		adaptation.WithPluginPath(empty), adaptation.WithPluginConfigPath(empty),
		adaptation.WithSocketPath(req.Socket))
	if err != nil {
		fail("%v", err)
	}
	if err := r.Start(); err != nil {
		fail("start: %v", err)
	}
	defer r.Stop()
	line, _ := json.Marshal(map[string]string{"listening": req.Socket})
	fmt.Println(string(line))

	deadline := time.Now().Add(time.Duration(req.WaitSeconds * float64(time.Second)))
	for pluginCount(r) < req.Plugins {
		if time.Now().After(deadline) {
			fail("no plugin registered within %.1fs", req.WaitSeconds)
		}
		time.Sleep(10 * time.Millisecond)
	}

	ctx := context.Background()
	for _, c := range cases {
		started := time.Now()
		response, err := r.CreateContainer(ctx, c)
		a := caseAnswer{Seconds: time.Since(started).Seconds()}
		if err != nil {
			a.Error = err.Error()
		} else {
			a.Response, _ = marshal.Marshal(response)
		}
		out.Cases = append(out.Cases, a)
	}
	if req.Repeat > 0 && len(cases) > 0 {
		for i := 0; i < req.Repeat; i++ {
			started := time.Now()
			if _, err := r.CreateContainer(ctx, cases[0]); err != nil {
				fail("repeat %d: %v", i, err)
			}
			out.RepeatSeconds = append(out.RepeatSeconds, time.Since(started).Seconds())
		}
	}
	mu.Lock()
	text, _ := json.Marshal(out)
	mu.Unlock()
	fmt.Println(string(text))
}
