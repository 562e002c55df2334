// randomk: being written (issue 3)
