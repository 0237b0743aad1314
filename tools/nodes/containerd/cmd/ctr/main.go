// Command ctr is the upstream containerd client, unchanged (the nodes import
// images with `ctr images import`).
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/containerd/v2/cmd/ctr/app"
)

func main() {
	if err := app.New().Run(context.Background(), os.Args); err != nil {
		_, _ = fmt.Fprintln(os.Stderr, "ctr:", err)
		os.Exit(1)
	}
}
