// Command nristub is a control plugin written with NRI's own plugin-side
// code (github.com/containerd/nri pkg/stub, Debian's
// golang-github-containerd-nri-dev, GOPATH mode).  On CreateContainer it
// adds one env (NRISTUB_SEEN=<container name>) and nothing else.
//
// The tests use it to show that what they observe is the plugin's doing:
// tests/e2e/nrigo reports this stub's adjustment exactly, and the containerd
// tests see its env in a container, so a container without hostpid's
// adjustment is not a harness that never reaches plugins.  The benchmark
// uses it as the reference round trip of a plugin in Go.
//
// Usage: nristub SOCKET INDEX
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type plugin struct{}

func (plugin) CreateContainer(_ context.Context, _ *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	adjust := &api.ContainerAdjustment{}
	adjust.AddEnv("NRISTUB_SEEN", ctr.GetName())
	return adjust, nil, nil
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: nristub SOCKET INDEX")
		os.Exit(2)
	}
	s, err := stub.New(plugin{}, stub.WithPluginName("nristub"), stub.WithPluginIdx(os.Args[2]),
		stub.WithSocketPath(os.Args[1]), stub.WithOnClose(func() { os.Exit(0) }))
	if err != nil {
		fmt.Fprintln(os.Stderr, "nristub:", err)
		os.Exit(2)
	}
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "nristub:", err)
		os.Exit(1)
	}
}
